"""The real machinery that tests and benchmarks run on, shared by `tests/` and `bench/`.

    netns      a cluster of hosts in network namespaces, one sshd each (root)
    sshd       a real OpenSSH sshd on loopback with generated keys
    mpiexec    ranks under the MPICH wheel's Hydra, with a clean environment and a hard timeout
    simcluster hundreds of hosts' real agents (relays too) in one process, fake PMI-1 ranks;
               simhead the real head over them (the `sim` transport row), simjob one measured
               job, simjoin rendezvous joins, simrank the ranks' conversation
    install_sysdeps.sh   what the machine needs for them (openssh-server, iproute2)

Not part of the installed dtrain package; imported from the repository root.
"""
