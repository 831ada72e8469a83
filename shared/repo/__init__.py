"""The model repository: versioned folders, imports (HF directory, GGUF), checksums, loading."""
