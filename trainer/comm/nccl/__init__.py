"""The NCCL backend of the `Communicator`: CUDA tensors over nccl4py, imported lazily.

* `trainer.comm.nccl.communicator`  `NcclCommunicator`: collectives on a side stream, p2p, split
* `trainer.comm.nccl.buffers`       contiguous staging, row blocks, event handles
* `trainer.comm.nccl.setup`         importing nccl4py, its version, the unique id over MPI
"""
