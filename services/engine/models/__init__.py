"""The engine's own model code: configs, forward passes and loaders."""
