// A native backtrace of a process that dies of SIGSEGV or SIGABRT (std::terminate), where there is no gdb: preloaded,
// it prints each frame of the signalled thread as library + offset (and the nearest exported symbol) to stderr, then
// exits with 128 + the signal's number.
//   gcc -shared -fPIC -o /tmp/native_backtrace.so tools/native_backtrace.c -ldl
//   LD_PRELOAD=/tmp/native_backtrace.so python3 repro.py
// `addr2line -f -C -e <library.so> <offset>` names our library's local functions (in its .symtab). Python's
// faulthandler (-X faulthandler, pytest) prints Python's stacks first, then hands the signal on to this handler.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
static void print_backtrace_and_exit(int signal_number, siginfo_t* info, void* context) {
  (void)context;
  void* frames[64];
  int n = backtrace(frames, 64);
  if (signal_number == SIGSEGV)
    fprintf(stderr, "%s at %p\n", strsignal(signal_number), info->si_addr);
  else
    fprintf(stderr, "%s\n", strsignal(signal_number));
  for (int i = 0; i < n; ++i) {
    Dl_info d;
    if (dladdr(frames[i], &d) && d.dli_fname) {
      fprintf(stderr, "#%d %s +0x%lx %s\n", i, d.dli_fname, (unsigned long)((char*)frames[i] - (char*)d.dli_fbase),
              d.dli_sname ? d.dli_sname : "?");
    } else {
      fprintf(stderr, "#%d %p\n", i, frames[i]);
    }
  }
  _exit(128 + signal_number);
}
__attribute__((constructor)) static void install(void) {
  struct sigaction sa = {0};
  sa.sa_sigaction = print_backtrace_and_exit;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGABRT, &sa, NULL);
}
