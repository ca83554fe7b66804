// Network policy with the official JS SDK: create with allowOut/denyOut, getInfo, updateNetwork,
// a refused domain rule (no ALL_TRAFFIC in denyOut). Prints one JSON line. Test hosts come from
// TEST_PORT / TEST_PUBLIC / TEST_PUBLIC2 / TEST_PRIVATE (tests/system/test_network_policy.py makes them).
import { Sandbox, ALL_TRAFFIC } from 'e2b'

const port = process.env.TEST_PORT
const addrs = [process.env.TEST_PUBLIC, process.env.TEST_PUBLIC2, process.env.TEST_PRIVATE]
const probe = `python3 - ${port} ${addrs.join(' ')} <<'EOF'
import json, socket, sys, concurrent.futures as cf
def probe(a):
    try:
        with socket.create_connection((a, int(sys.argv[1])), timeout=1.0) as c:
            return "OPEN" if c.recv(4) == b"pong" else "ODD"
    except OSError:
        return "BLOCKED"
with cf.ThreadPoolExecutor(len(sys.argv) - 2) as ex:
    print(json.dumps(dict(zip(sys.argv[2:], ex.map(probe, sys.argv[2:])))))
EOF`
const reach = async (sbx) => JSON.parse((await sbx.commands.run(probe, { timeoutMs: 30_000 })).stdout)

const sbx = await Sandbox.create('base', {
  timeoutMs: 120_000,
  network: { denyOut: [ALL_TRAFFIC], allowOut: [process.env.TEST_PUBLIC] },
})
const out = { sandboxId: sbx.sandboxId }
try {
  out.created = await reach(sbx)
  const info = (await sbx.getInfo()).network ?? {}
  out.info = { allowOut: info.allowOut, denyOut: info.denyOut }
  await sbx.updateNetwork({ allowOut: [process.env.TEST_PRIVATE] })
  out.updated = await reach(sbx)
} finally {
  await sbx.kill()
}
try {
  const bad = await Sandbox.create('base', {
    timeoutMs: 60_000,
    network: { allowOut: ['example.com'] }, // a domain needs ALL_TRAFFIC denied (E2B)
  })
  await bad.kill()
  out.refused = 'created'
} catch (err) {
  out.refused = String(err.message ?? err)
}
console.log(JSON.stringify(out))
