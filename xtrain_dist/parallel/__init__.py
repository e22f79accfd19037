"""How ranks share the work: gradient synchronisation (ddp) and the ZeRO-1 optimizer (zero)."""
