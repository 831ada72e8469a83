"""The model repository: versioned folders, imports (HF directory, GGUF), checksums, model shapes
(presets, servable length), and resolving what ``--model`` names into a directory the engine's loader
reads. It sits below the engine, which imports it; it never imports the engine (the gateway imports it)."""
