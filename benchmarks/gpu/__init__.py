"""GPU runs (H100/H200): the suite, throughput, decode profiles, kernel tuning; results/ holds their JSON."""
