"""Where training runs: the devices and the native backend an engine runs on, the CUDA stream it follows,
and Ctrl-C held off between a native call and the Python that mirrors it."""
