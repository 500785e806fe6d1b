"""Shards of a remote folder (an object store): the node's cache of copies
(`cache.ShardCache`), the background fetch of the next shards (`prefetch.Prefetch`), and one
iterator's reading of a stream through them (`reading.RemoteReading`)."""
