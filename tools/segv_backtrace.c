// A native backtrace of a process that dies of SIGSEGV, where there is no gdb: preloaded, it prints each frame as
// library + offset (and the nearest exported symbol) to stderr, then exits with 139.
//   gcc -shared -fPIC -o /tmp/segv_backtrace.so tools/segv_backtrace.c -ldl
//   LD_PRELOAD=/tmp/segv_backtrace.so python3 repro.py
// `addr2line -f -C -e <library.so> <offset>` names our library's local functions (in its .symtab).
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>
#include <dlfcn.h>
static void print_backtrace_and_exit(int signal_number, siginfo_t* info, void* context) {
  (void)signal_number;
  (void)context;
  void* frames[64];
  int n = backtrace(frames, 64);
  fprintf(stderr, "SIGSEGV at %p\n", info->si_addr);
  for (int i = 0; i < n; ++i) {
    Dl_info d;
    if (dladdr(frames[i], &d) && d.dli_fname) {
      fprintf(stderr, "#%d %s +0x%lx %s\n", i, d.dli_fname, (unsigned long)((char*)frames[i] - (char*)d.dli_fbase),
              d.dli_sname ? d.dli_sname : "?");
    } else {
      fprintf(stderr, "#%d %p\n", i, frames[i]);
    }
  }
  _exit(139);
}
__attribute__((constructor)) static void install(void) {
  struct sigaction sa = {0};
  sa.sa_sigaction = print_backtrace_and_exit;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, NULL);
}
