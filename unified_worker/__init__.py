"""The unified role: one process reads jobs, prefills and decodes them, with no handoff."""
