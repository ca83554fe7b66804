// Build a template with the official JS SDK's Template builder, create a sandbox from it, and
// build a failing one; prints one JSON line of results. Args: <template name> <context dir>.
// Connection settings come from E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY.
import { Sandbox, Template } from 'e2b'

const [name, contextDir] = process.argv.slice(2)
const out = { existsBefore: await Template.exists(name) }
const template = Template({ fileContextPath: contextDir })
  .fromTemplate('base')
  .setEnvs({ JS_WORD: 'js-build' })
  .copy('hello.txt', '/tmp/ctx/')
  .runCmd('mkdir -p /home/user/js && echo "$JS_WORD $(cat /tmp/ctx/hello.txt)" > /home/user/js/out.txt')
  .runCmd('echo js-owned; chown -R user /home/user/js', { user: 'root' })
const started = Date.now()
await Template.build(template, name)
out.buildMs = Date.now() - started
out.existsAfter = await Template.exists(name)
const sbx = await Sandbox.create(name, { timeoutMs: 120_000 })
try {
  out.read = await sbx.files.read('/home/user/js/out.txt')
} finally {
  await sbx.kill()
}
try {
  await Template.build(Template().fromTemplate('base').runCmd('echo js-fails; exit 7'), `${name}-fail`)
  out.failed = null
} catch (err) {
  out.failed = String(err.message)
}
console.log(JSON.stringify(out))
