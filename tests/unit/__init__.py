"""Pure logic: frames, identity, config, layouts, transfer plans, memory, metrics, plan/replay, CLI errors."""
