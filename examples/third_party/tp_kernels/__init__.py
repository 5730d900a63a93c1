"""The example's kernel package ([build] kernel_packages): one registered kernel."""
