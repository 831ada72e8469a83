"""The codec's bounds on anything decoded, and the field metadata its rolling-upgrade rules read (codec.py)."""

# Bounds on anything decoded. A control message this big is a bug or an attack, never a request.
MAX_MESSAGE_BYTES = 32 * 1024 * 1024
MAX_ARRAY_LEN = 4 * 1024 * 1024  # prompt token ids are the longest arrays
MAX_STR_LEN = 1024 * 1024
MAX_MAP_LEN = 4096
MAX_ID_LEN = 256  # request / worker ids, model names

# field metadata: a peer that does not know the field may ignore it (it needs a default: older peers never send it)
IGNORABLE = {"ignorable": True}
IGNORABLE_KEY = "~ignorable"  # the ignorable fields a map carries (never a field name: not an identifier)
# field metadata "absent": what a missing field means when that is not the field's default (version.py's field)
ABSENT = "absent"
