"""Stated maximums that inputs are checked against before anything is allocated; one place,
read by fit's arguments and the hosts file alike (standard library only)."""

#: The most ranks a run may have (num_nodes, and the slots of a hosts file added up).
MAX_NUM_NODES = 1024
#: The most samples a rank takes in a step (``batch_size``) or an evaluation (``val_size``).
MAX_BATCH_SIZE = 1 << 24
#: The most compute threads a rank may ask for (``num_threads``).
MAX_NUM_THREADS = 1024
