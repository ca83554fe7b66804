"""The filesystem service (E2B envd's filesystem.Filesystem): entries, access as a user,
watches (inotify), the metadata store, freezing for snapshots."""
