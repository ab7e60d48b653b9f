// Directory streams. They pass through today; they are exported so that the load side can hide
// the files of an old topology from a listing (DESIGN.md §3, load step 3) without a change to
// the exported symbol list.

#include <dirent.h>

#include "interpose/gate.h"
#include "interpose/real.h"

extern "C" UCP_EXPORT DIR* opendir(const char* path) { return ucp::real::opendir()(path); }

extern "C" UCP_EXPORT DIR* fdopendir(int fd) { return ucp::real::fdopendir()(fd); }

extern "C" UCP_EXPORT struct dirent* readdir(DIR* dir) { return ucp::real::readdir()(dir); }

extern "C" UCP_EXPORT struct dirent64* readdir64(DIR* dir) { return ucp::real::readdir64()(dir); }

extern "C" UCP_EXPORT int closedir(DIR* dir) { return ucp::real::closedir()(dir); }
