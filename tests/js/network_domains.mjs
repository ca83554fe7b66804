// Domain rules in allowOut with the official JS SDK: create with a name and a wildcard, getInfo,
// updateNetwork. Prints one JSON line. TEST_IP is the test host that
// tests/system/test_network_domains.py makes (HTTPS on 443, HTTP on 80).
import { Sandbox, ALL_TRAFFIC } from 'e2b'

const ip = process.env.TEST_IP
// One curl per name, `name=<body>` or `name=FAIL <exit code>`.
const reach = async (sbx, ...targets) => {
  const script = targets
    .map(([name, port]) => {
      const url = `${port === 443 ? 'https' : 'http'}://${name}:${port}/`
      return `(out=$(curl -sk --max-time 4 --resolve ${name}:${port}:${ip} ${url}) && echo "${name}:${port}=$out" || echo "${name}:${port}=FAIL $?") &`
    })
    .join('\n')
  const { stdout } = await sbx.commands.run(`${script}\nwait`, { timeoutMs: 60_000 })
  return Object.fromEntries(stdout.trim().split('\n').map((line) => line.split(/=(.*)/s).slice(0, 2)))
}

const sbx = await Sandbox.create('base', {
  timeoutMs: 120_000,
  network: { allowOut: ['js.example', '*.example.org'], denyOut: [ALL_TRAFFIC] },
})
const out = { sandboxId: sbx.sandboxId }
try {
  out.created = await reach(sbx, ['js.example', 443], ['x.example.org', 80], ['no.example', 443])
  out.info = (await sbx.getInfo()).network?.allowOut
  await sbx.updateNetwork({ allowOut: ['no.example'], denyOut: [ALL_TRAFFIC] })
  out.updated = await reach(sbx, ['js.example', 443], ['no.example', 443])
} finally {
  await sbx.kill()
}
console.log(JSON.stringify(out))
