# forkyard: one image for every role (`forkyard serve`, `forkyard node serve`, `forkyard gateway`).
#
#   scripts/docker.sh images        # or: docker build -t forkyard:latest .  (where Docker Hub answers)
#   docker run --cap-add SYS_ADMIN --cap-add NET_ADMIN --cap-add SYS_PTRACE \
#     --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
#     --device /dev/loop-control --device-cgroup-rule 'b 7:* rmw' \
#     -p 3000:3000 -v forkyard-data:/var/lib/forkyard --entrypoint forkyard-node-init \
#     forkyard:latest forkyard serve --host 0.0.0.0
#
# Roles that run gVisor sandboxes (`serve`, `node serve`) need those privileges, not --privileged
# (README "Cluster", "What the container needs"; measured in tests/system/test_compose_cluster.py):
# runsc makes mounts and namespaces and per-sandbox cgroups, a sandbox's disk is a loop device,
# the network code makes veth pairs and iptables NAT. forkyard-node-init (deploy/docker/node-init.sh)
# makes the loop device nodes and the cgroup hierarchies writable first. QEMU sandboxes also want
# /dev/kvm and /dev/net/tun. The gateway needs none of it. The `base` template is built into the
# data volume on first use (`forkyard template build base`, debootstrap from a Debian mirror).
# The base: Debian 12. Where no registry but Debian's is reachable, `scripts/docker.sh base` makes one
# from Debian itself (debootstrap + `docker import`) and the build takes it with
# --build-arg BASE_IMAGE=<its tag> (`make image`, the tests).
ARG BASE_IMAGE=debian:12-slim
FROM ${BASE_IMAGE}

# gVisor from bookworm-backports, the exact build scripts/bootstrap.sh pins (RUNSC_PIN[bookworm]):
# gVisor is sensitive to the Go runtime it was built with and the runtime relies on this
# release's flags. tests/unit/test_deploy.py fails when the two pins differ.
ARG RUNSC_VERSION=0.0~20240729.0-4~bpo12+2

# What scripts/bootstrap.sh installs for running (not its build- and test-only packages:
# gcc, libc6-dev, protobuf-compiler, the tests' postgresql-15), plus Python. apt lists are dropped to keep the image small:
# `forkyard image build` (microVM guest kernels, `apt-get download`) needs `apt-get update` first.
# A TLS-intercepting egress proxy's CA, where the build's HTTPS (pip) passes through one (PEM text;
# `make image` passes the host's /usr/local/share/ca-certificates). Empty: none.
ARG EXTRA_CA_PEM=""
RUN printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      > /etc/apt/sources.list.d/forkyard-bookworm-backports.sources \
 && printf 'Package: runsc\nPin: version %s\nPin-Priority: 1001\n' "$RUNSC_VERSION" \
      > /etc/apt/preferences.d/forkyard-runsc \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      "runsc=$RUNSC_VERSION" \
      python3 python3-venv ca-certificates \
      debootstrap iproute2 iptables busybox-static qemu-system-x86 xfsprogs e2fsprogs erofs-utils \
      cpio zstd procps psmisc util-linux kmod patchelf binutils skopeo umoci libnss-myhostname \
 && rm -rf /var/lib/apt/lists/* \
 && if [ -n "$EXTRA_CA_PEM" ]; then \
      printf '%s\n' "$EXTRA_CA_PEM" > /usr/local/share/ca-certificates/build-extra.crt && update-ca-certificates; \
    fi

# The package in its own venv. Direct dependencies are pinned exactly in pyproject.toml; the
# lock pins the whole closure (deploy/docker/update-lock.sh regenerates it).
COPY deploy/docker/node-init.sh /usr/local/bin/forkyard-node-init
COPY deploy/docker/requirements.lock /tmp/requirements.lock
COPY pyproject.toml README.md /src/
COPY forkyard /src/forkyard
RUN python3 -m venv /opt/forkyard \
 && PIP_CERT=/etc/ssl/certs/ca-certificates.crt /opt/forkyard/bin/pip install --no-cache-dir --disable-pip-version-check -c /tmp/requirements.lock /src \
 && rm -rf /src /tmp/requirements.lock
ENV PATH=/opt/forkyard/bin:$PATH \
    FORKYARD_DATA_DIR=/var/lib/forkyard

VOLUME /var/lib/forkyard
# The API and envd proxy (3000); the HTTPS listener for sandbox URLs (3443, `serve` only).
EXPOSE 3000 3443
ENTRYPOINT ["forkyard"]
CMD ["serve", "--host", "0.0.0.0"]
