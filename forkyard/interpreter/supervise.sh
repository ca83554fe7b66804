#!/bin/sh
# Keeps the code interpreter's server running: the template's start command (gVisor sandboxes have
# no systemd). The server is started again whenever it exits (a crash, a kill by the user's code,
# the OOM killer), after a pause that grows while it keeps failing; its kernels die with it
# (jupyter_client's parent poller) and the new server starts its default kernel again.
# A shell, not Python: it stays resident in every idle sandbox, where a Python supervisor took
# ~9 MiB of host memory (PSS) per sandbox. Usage: supervise.sh [server arguments]
cd "$(dirname "$0")/.." || exit 1
child=
trap 'stopping=1; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null' TERM INT
pause=0.2
while [ -z "$stopping" ]; do
  started=$(date +%s)
  python3 -m interpreter serve "$@" &
  child=$!
  wait "$child"
  code=$?
  [ -n "$stopping" ] && break
  # A server that ran this long was healthy: its next failure starts over from the first pause.
  [ $(($(date +%s) - started)) -gt 30 ] && pause=0.2
  echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) the server exited with $code: starting it again in ${pause}s" >&2
  sleep "$pause"
  case $pause in 0.2) pause=0.4 ;; 0.4) pause=0.8 ;; 0.8) pause=1.6 ;; 1.6) pause=3.2 ;; *) pause=5 ;; esac
done
