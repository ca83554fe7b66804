"""The owner of the template lifecycle: the builds (its :class:`TemplateBuilder`, composed here
once) and the deletes of templates and of user snapshots.

E2B has one namespace for both: a snapshot *is* a template (openapi.yml's ``SnapshotInfo``:
"Identifier of the snapshot template"), and the SDKs delete either with the same
``DELETE /templates/{templateID}`` (``Sandbox.delete_snapshot`` sends the snapshot's id there).
:meth:`TemplateOwner.delete` therefore decides what the id names: a user snapshot by its id, a
template built through the build API by its name, else a user snapshot by its name.
"""

from __future__ import annotations

import asyncio
import time

from forkyard.config import Settings
from forkyard.errors import Conflict, Forbidden, NotFound
from forkyard.orchestrator.background import Background
from forkyard.orchestrator.builder import TemplateBuilder
from forkyard.orchestrator.catalog import SnapshotCatalog
from forkyard.orchestrator.garbage import GarbageCollector
from forkyard.orchestrator.rowless import RowlessSandboxes
from forkyard.orchestrator.runtimes import RuntimeSet
from forkyard.orchestrator.standbys import Standbys
from forkyard.orchestrator.template_snapshots import TemplateSnapshots
from forkyard.storage import templates as storage
from forkyard.storage.snapshots import SnapshotRow

#: How long a delete waits for the template's snapshots being made in the background.
SNAPSHOT_SETTLE_SECONDS = 60.0


def unqualified(template_id: str) -> str:
    """``team/name:tag`` -> ``name:tag``: E2B's names carry the team's namespace; a node has none."""
    return template_id.rsplit("/", 1)[-1]


class TemplateOwner:
    def __init__(
        self,
        settings: Settings,
        *,
        catalog: SnapshotCatalog,
        runtimes: RuntimeSet,
        template_snapshots: TemplateSnapshots,
        standbys: Standbys,
        background: Background,
        garbage: GarbageCollector,
        rowless: RowlessSandboxes,
    ) -> None:
        self._settings = settings
        self._catalog = catalog
        self._template_snapshots = template_snapshots
        self._standbys = standbys
        self._garbage = garbage
        self.builder = TemplateBuilder(
            settings, runtimes, template_snapshots, background, collect=garbage.collect, rowless=rowless
        )

    async def close(self) -> None:
        """After the server's background work is drained (builds under way are cancelled there)."""
        await self.builder.close()

    async def delete(self, template_id: str) -> None:
        """E2B's ``DELETE /templates/{templateID}``: a user snapshot or a built template."""
        key = unqualified(template_id)
        by_id = await self._catalog.store.get(key.split(":")[0])
        if by_id is not None and by_id.kind == "snapshot":
            await self._delete_snapshot(by_id)
            return
        name = self._template_name(key)
        if name and (storage.is_built(name, self._settings) or self.builder.builds_of(name)):
            await self._delete_template(name)
            return
        await self.delete_snapshot(template_id)

    async def delete_snapshot(self, name_or_id: str) -> None:
        row = await self._catalog.find_user_snapshot(name_or_id)
        if row is None:
            raise NotFound(f"template '{name_or_id}' not found")
        await self._delete_snapshot(row)

    async def _delete_snapshot(self, row: SnapshotRow) -> None:
        await self._standbys.forget(row.snapshot_id)
        await self._catalog.delete(row.snapshot_id)
        await self._garbage.settled()  # the delete answers once what it freed is gone

    @staticmethod
    def _template_name(key: str) -> str:
        try:
            return storage.split_name(key)[0]
        except storage.InvalidTemplateId:
            return ""

    async def _delete_template(self, name: str) -> None:
        """A template built through the build API (with its snapshots and warm pool): no name
        finds it any more, but its sandboxes keep running and snapshots of it keep restoring.
        The node's recipe templates (``base``) are not the API's to delete."""
        if self.builder.building(name):
            raise Conflict(f"template '{name}' is being built; delete it when the build has ended")
        if name in storage.RECIPES or (
            storage.is_built(name, self._settings)
            and not storage.read_metadata(name, self._settings).get("build_id")
        ):
            raise Forbidden(f"template '{name}' is built from this node's recipe (forkyard template build)")
        await self._settle_template_snapshots(name)
        await self._template_snapshots.forget(name)
        self.builder.forget(name)
        if storage.template_dir(name, self._settings).exists():
            storage.delete_template(name, self._settings)
        # Its builds' roots go now unless a sandbox or snapshot stands on them (E2B's: those keep
        # running and restoring); then when the last of them goes.
        await self._garbage.collect()

    async def _settle_template_snapshots(self, name: str) -> None:
        """Wait for the template's snapshots being made in the background (a create of an older
        build starts one) to land, so the delete drops them too instead of leaving a snapshot and
        a warm pool on a deleted build."""
        deadline = time.monotonic() + SNAPSHOT_SETTLE_SECONDS
        while self._template_snapshots.making(name) and time.monotonic() < deadline:  # noqa: ASYNC110 (no event to wait on)
            await asyncio.sleep(0.1)
