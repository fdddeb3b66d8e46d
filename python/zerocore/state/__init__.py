"""The model states and where they live: the placement of each stage, the plan of units and flat groups,
initialisation from the meta device, the partition's update (in place or offloaded), deterministic mode's exact sums."""
