"""Benchmarks (``cula bench``): cpu (the CPU path against the float64 reference), kda (the KDA chunked
forward against FLA, FlashKDA and torch SDPA), fwd (GDN, GLA, simple GLA, Lightning against FLA),
decode (against FLA and the copy bandwidth); common: the timers, reports and plots they share."""
