"""DeepSpeed JSON configs read as zerocore Configs, and their lr schedules."""
