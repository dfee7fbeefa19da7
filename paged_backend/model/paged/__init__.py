"""What a layer's forward reads and writes in a step: the paged cache and its probe, the attention function,
the custom ops and the latent cache, the recurrent state, and the step context that holds them."""
