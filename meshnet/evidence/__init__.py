"""What meshnet measures about itself: accept, bench, drift, the parity check and the stock
llama.cpp reference. Imports core, engine, net, route and launch."""
