"""How a job fails: every rank stops within seconds, and each says which rank stopped first and
how (the board and heartbeats in the rendezvous store, signals caught even inside a collective)."""
