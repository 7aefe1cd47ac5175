"""Host side of the Triton kernels in :mod:`flashtile.kernels`: planning (tiles, split counts),
launches bound once per problem signature, and the per-device buffers the kernels share (arrival
counters, error words).  The public API in :mod:`flashtile.ops` validates its arguments and calls
these; the functions here trust their callers' shapes (see each module)."""
