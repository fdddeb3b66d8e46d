"""Model state in and out: checkpoints (engine.save/load, their files), safetensors export, and the in-memory
snapshots restored after a lost rank."""
