// Create, run, write, read, list, kill with the official JS SDK; prints one JSON line of results.
// Connection settings come from E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY.
import { Sandbox } from 'e2b'

const started = Date.now()
const sbx = await Sandbox.create('base', { timeoutMs: 120_000, metadata: { suite: 'js' } })
const out = { sandboxId: sbx.sandboxId, createMs: Date.now() - started }
try {
  const run = await sbx.commands.run('echo hi-from-js && echo err >&2')
  out.stdout = run.stdout
  out.stderr = run.stderr
  out.exitCode = run.exitCode
  await sbx.files.write('/home/user/js.txt', 'written by js')
  out.read = await sbx.files.read('/home/user/js.txt')
  out.listed = (await sbx.files.list('/home/user')).map((e) => e.name).includes('js.txt')
  const page = await Sandbox.list({ query: { metadata: { suite: 'js' } } }).nextItems()
  out.found = page.map((s) => s.sandboxId)
  out.info = (await sbx.getInfo()).templateId
} finally {
  out.killed = await sbx.kill()
}
out.runningAfterKill = await sbx.isRunning()
console.log(JSON.stringify(out))
