"""--ssh-client openssh: the agents over the system `ssh` client (`session`), with the ssh
config read by `ssh -G` and refused as for paramiko (`config`)."""
