"""Stated maximums that inputs are checked against before anything is allocated; one place,
read by fit's arguments and the hosts file alike (standard library only)."""

#: The most ranks a run may have (num_nodes, and the slots of a hosts file added up).
MAX_NUM_NODES = 1024
