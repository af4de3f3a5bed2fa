"""WebShop: pages, actions and reward as the benchmark defines them, on a generated or real catalogue."""
