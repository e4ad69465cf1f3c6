"""The codec: an object encoded into frames or parts, decoded whole or in chunks, verified."""
