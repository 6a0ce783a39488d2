"""Training: the LightningModule, the population of runs trained as one, and the one configuration path."""
