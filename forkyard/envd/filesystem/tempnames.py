"""Names of the temporary files uploads are written to before the rename into place.

Watchers hide these files and report the upload the way an in-place write looks (what E2B's envd
and the SDK's watch tests expect): ``create`` (new file) then ``write`` on the target's name.
"""

from __future__ import annotations

import os
import re

_PATTERN = re.compile(r"^\.(?P<target>.+)\.envd-(?P<kind>new|over)-[0-9a-f]{12}$")


def temp_upload_name(target_name: str, replacing: bool) -> str:
    return f".{target_name}.envd-{'over' if replacing else 'new'}-{os.urandom(6).hex()}"


def parse_temp_upload_name(name: str) -> tuple[str, bool] | None:
    """(target name, whether the target is new) for an upload temp file, else None."""
    match = _PATTERN.match(name)
    if match is None:
        return None
    return match["target"], match["kind"] == "new"
