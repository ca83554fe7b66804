// Volumes with the official JS SDK: create, content round trip, a sandbox mounting the volume
// sees what the content API wrote and the API sees what it wrote; prints one JSON line.
// Connection settings come from E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY / E2B_VOLUME_API_URL.
import { Sandbox, Volume } from 'e2b'

const vol = await Volume.create(`js-${Date.now()}`)
const out = { name: vol.name }
try {
  await vol.makeDir('/data', { force: true })
  out.written = (await vol.writeFile('/data/in.txt', 'from js')).size
  out.read = await vol.readFile('/data/in.txt')
  out.listed = (await vol.list('/data')).map((e) => e.name)
  out.inList = (await Volume.list()).some((v) => v.volumeId === vol.volumeId)
  const sbx = await Sandbox.create('base', { timeoutMs: 120_000, volumeMounts: { '/mnt/js': vol } })
  try {
    out.seenInSandbox = (await sbx.commands.run('cat /mnt/js/data/in.txt && echo back > /mnt/js/out.txt')).stdout
    out.mounts = (await sbx.getInfo()).volumeMounts
  } finally {
    await sbx.kill()
  }
  out.back = await vol.readFile('/out.txt')
} finally {
  out.destroyed = await Volume.destroy(vol.volumeId)
}
console.log(JSON.stringify(out))
