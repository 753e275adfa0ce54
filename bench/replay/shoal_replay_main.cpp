// shoal_replay: replays allocation traces through shoal (see replay_cli.h).
#include "bench/replay/replay_cli.h"

int main(int argc, char** argv) { return shoal::bench::replay_main(argc, argv, {}); }
