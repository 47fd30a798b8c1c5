"""moescope's core: what every producer and consumer shares, importing none of them."""
