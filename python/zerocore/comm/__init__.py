"""How ranks talk: the collectives on the native queue (communicator), their transports (torch.distributed
groups, the native NCCL), each rank's published position and the errors of ranks that disagree."""
