"""Graders of the parallel family: collectives, data parallelism (DDP, ZeRO, FSDP), tensor, sequence, pipeline and
expert parallelism, activation checkpointing and memory accounting. One test module per problem; models holds the
small models they train."""
