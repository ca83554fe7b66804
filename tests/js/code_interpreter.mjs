// E2B's code interpreter through the published @e2b/code-interpreter; prints one JSON line of what
// it saw (tests/system/test_code_interpreter_js.py checks it). Connection settings come from
// E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY; the SDK's default template is code-interpreter-v1.
import { Sandbox } from '@e2b/code-interpreter'

const started = Date.now()
const sbx = await Sandbox.create({ timeoutMs: 300_000, envs: { LEVEL: 'sandbox' } })
const out = { createMs: Date.now() - started }
try {
  const first = await sbx.runCode('1+1')
  out.firstRunMs = Date.now() - started
  out.text = first.text
  out.executionCount = first.executionCount
  const stdout = []
  const logs = await sbx.runCode("import sys\nprint('js-out')\nprint('js-err', file=sys.stderr)", {
    onStdout: (m) => stdout.push(m.line),
  })
  out.stdout = logs.logs.stdout.join('')
  out.stderr = logs.logs.stderr.join('')
  out.onStdout = stdout.join('')
  const failed = await sbx.runCode("raise KeyError('missing')")
  out.error = { name: failed.error?.name, value: failed.error?.value, hasTraceback: !!failed.error?.traceback }
  const chart = await sbx.runCode(
    "import matplotlib.pyplot as plt\nplt.bar(['a', 'b'], [3, 5])\nplt.title('bars')\nplt.show()",
  )
  const figure = chart.results[0]
  out.chart = { formats: figure.formats(), type: figure.chart?.type, title: figure.chart?.title, png: !!figure.png }
  const frame = await sbx.runCode("import pandas as pd\npd.DataFrame({'a': [1]})")
  out.data = frame.results[0].data
  out.envs = [
    (await sbx.runCode("import os; os.environ['LEVEL']")).text,
    (await sbx.runCode("os.environ['LEVEL']", { envs: { LEVEL: 'cell' } })).text,
    (await sbx.runCode("os.environ['LEVEL']")).text,
  ]
  const ctx = await sbx.createCodeContext({ cwd: '/tmp', language: 'python' })
  out.context = { language: ctx.language, cwd: ctx.cwd }
  out.contextCwd = (await sbx.runCode('import os; os.getcwd()', { context: ctx })).text
  out.listed = (await sbx.listCodeContexts()).some((c) => c.id === ctx.id)
  await sbx.restartCodeContext(ctx)
  await sbx.removeCodeContext(ctx.id)
  out.listedAfterRemove = (await sbx.listCodeContexts()).some((c) => c.id === ctx.id)
  const js = await sbx.runCode("const answer = await Promise.resolve(41); console.log(answer + 1)", { language: 'js' })
  out.js = js.logs.stdout.join('').trim()
  const jsValue = await sbx.runCode('1+1', { language: 'js' })
  out.jsValue = { text: jsValue.text, main: jsValue.results.map((r) => r.isMainResult), stdout: jsValue.logs.stdout }
  const ts = await sbx.runCode('const t: number = 2;\nconsole.log(t * 21)', { language: 'ts' })
  out.ts = ts.logs.stdout.join('').trim()
  const bash = await sbx.runCode('echo bash-$((40+2))', { language: 'bash' })
  out.bash = bash.logs.stdout.join('').trim()
  await sbx.runCode("kept = 'before'")
  try {
    await sbx.runCode("import time\nkept = 'during'\ntime.sleep(60)", { timeoutMs: 3_000 })
    out.timeout = 'no error'
  } catch (err) {
    out.timeout = err.name
  }
  out.afterTimeout = (await sbx.runCode('kept')).text
} finally {
  await sbx.kill()
}
console.log(JSON.stringify(out))
