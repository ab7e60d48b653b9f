// Forks and execs itself: the exec'd child (a fresh process, with LD_PRELOAD inherited) writes
// a file; the parent prints what it wrote.

#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

int main(int argc, char** argv) {
  if (argc == 3 && strcmp(argv[2], "child") == 0) {
    FILE* f = fopen((std::string(argv[1]) + "/exec_child.txt").c_str(), "w");
    if (f == nullptr) return 1;
    fprintf(f, "written by the exec'd child\n");
    return fclose(f) == 0 ? 0 : 1;
  }
  if (argc != 2) return 2;
  const pid_t pid = fork();
  if (pid == 0) {
    execl("/proc/self/exe", argv[0], argv[1], "child", static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  std::ifstream in(std::string(argv[1]) + "/exec_child.txt");
  std::ostringstream text;
  if (in) text << in.rdbuf();
  std::cout << "child exit " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1) << ": "
            << text.str();
  return 0;
}
