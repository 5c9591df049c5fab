"""Real-system test fixtures: an OpenSSH sshd on loopback and a network-namespace cluster.

Both start real daemons as root and clean up only the processes and namespaces they created
(by recorded PID or by listing their own namespaces), never by name patterns.
"""
