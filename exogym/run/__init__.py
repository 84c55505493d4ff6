"""Running a training: Trainer, each rank's process, TrainNode's loop, devices, memory, checkpoints."""
