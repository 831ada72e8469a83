"""The decode role: admits handed-off requests, decodes them, streams tokens back."""
