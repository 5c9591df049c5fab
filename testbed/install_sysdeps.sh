#!/usr/bin/env bash
# Installs the system tools the tests use (sshd, ip, pdsh, Slurm, munge, cc) when running as root;
# otherwise only reports.
set -euo pipefail
need=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v pdsh >/dev/null 2>&1 || need+=(pdsh)
# A real Slurm for tests/test_slurm_*.py and bench/slurm.py (testbed/slurm.py runs it).
[ -x /usr/sbin/slurmctld ] || need+=(slurmctld)
[ -x /usr/sbin/slurmd ] || need+=(slurmd)
command -v srun >/dev/null 2>&1 || need+=(slurm-client)
[ -x /usr/sbin/munged ] || need+=(munge)
# A C compiler builds the shared library whose loading tests/cluster/test_ssh_config_refusal.py detects.
command -v cc >/dev/null 2>&1 || need+=(gcc)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "sysdeps: not root; tests needing ${need[*]} will be skipped" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
