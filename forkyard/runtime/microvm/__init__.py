"""What the microVM runtimes (QEMU, Firecracker) share.

Both boot the same guest artifacts (:mod:`forkyard.storage.images`) as a VM process in the
sandbox's netns, behind a tap device (:mod:`.vmnet`), with the sandbox's writable upper drive a
reflink clone in the pool (:mod:`.disks`). :class:`.runtime.MicroVmRuntime` owns the lifecycle
they have in common (directories and their marker, network, pause keeping the network, kill,
metrics, orphan clean-up); each runtime adds how its VMM is started, configured and snapshotted.
:mod:`.host` holds the process and envd helpers.
"""
