"""The engine: the only code of the project that imports DeepSpeed (docs/architecture.md)."""
