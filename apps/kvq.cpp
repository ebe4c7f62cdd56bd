// kvq: command-line entry point. Argument parsing and dispatch only.
#include <cstdio>

int main(int argc, char** argv) {
  (void)argc;
  (void)argv;
  std::fprintf(stderr, "kvq: no subcommands yet\n");
  return 1;
}
