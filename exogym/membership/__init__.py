"""Which ranks take part: simulated drop-outs, real hosts that come and go, hand-over to joiners."""
