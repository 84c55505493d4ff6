#!/usr/bin/env bash
# Installs the system packages the test suite uses: sshd for the launcher's
# tests, espeak-ng for synthesized speech, iproute2 for network namespaces,
# SLURM and munge for a one-node cluster (tests/slurm_fixture.py), headless
# chromium and its driver for the browser dashboard (tests/test_web_dashboard.py),
# nftables for injected cuts of a host's traffic (tests/test_inject.py, bench.chaos).
# Does nothing for packages already present; uses sudo when not root.
set -euo pipefail
need=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh-keygen >/dev/null 2>&1 || need+=(openssh-client)
command -v espeak-ng >/dev/null 2>&1 || need+=(espeak-ng)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v nft >/dev/null 2>&1 || [ -x /usr/sbin/nft ] || need+=(nftables)
command -v tmux >/dev/null 2>&1 || need+=(tmux)
command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ] || need+=(slurmctld)
command -v slurmd >/dev/null 2>&1 || [ -x /usr/sbin/slurmd ] || need+=(slurmd)
command -v srun >/dev/null 2>&1 || need+=(slurm-client)
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || need+=(munge)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
[ -x /usr/bin/chromedriver ] || need+=(chromium-driver)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "tests/setup_system.sh: need root or sudo to install: ${need[*]}" >&2; exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
