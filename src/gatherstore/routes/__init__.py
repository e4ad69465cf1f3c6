"""Routes: how one call's parts travel (collective, inline, store, stream, handover, chunked)."""
