"""The model repository: versioned folders, imports (HF directory, GGUF), checksums, and resolving what
``--model`` names into a directory the engine's loader reads."""
