"""envd's HTTP surface: the app (/health, /init, /envs, /metrics), the files API with its
multipart uploads and signed URLs, and the Connect RPC mounts of the two services."""
